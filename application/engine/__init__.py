"""The engine: one step at a time (schedule, run, apply, output, observe), its loop, its
clients (local and a fleet's) and what prepares requests for it."""
