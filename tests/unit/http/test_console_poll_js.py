"""The console's poller (``console-data.js``'s ``poll``) under Node, where Node is
installed: a ``now()`` during a tick runs one tick after it — one loop at a time, never
two — and ``stop()`` stops it (a second loop once kept polling after its page was left)."""

import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).parents[3] / "adapters" / "http" / "console" / "static"
HARNESS = """
import { poll } from '%s';
let ticks = 0, concurrent = 0, maxConcurrent = 0;
const tick = async () => {
  ticks++; concurrent++; maxConcurrent = Math.max(maxConcurrent, concurrent);
  await new Promise(r => setTimeout(r, 30));
  concurrent--;
};
const p = poll(tick, 50);
await new Promise(r => setTimeout(r, 10));
p.now(); p.now();  // during the first tick
await new Promise(r => setTimeout(r, 400));
p.stop();
const stoppedAt = ticks;
await new Promise(r => setTimeout(r, 200));
console.log(JSON.stringify({maxConcurrent, ticks: stoppedAt, after: ticks}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js here")
def test_now_during_a_tick_keeps_one_loop(tmp_path: Path) -> None:
    import json

    script = tmp_path / "poll.mjs"
    script.write_text(HARNESS % (STATIC / "console-data.js").as_uri())
    out = subprocess.run(
        ["node", str(script)], capture_output=True, text=True, timeout=30, check=True
    )
    result = json.loads(out.stdout)
    assert result["maxConcurrent"] == 1
    assert result["after"] == result["ticks"]  # nothing after stop()
    assert 2 <= result["ticks"] <= 8  # one loop: a tick each ~80 ms at most, plus the one asked
