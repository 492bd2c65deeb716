"""Who may call and how much: API keys, tenants, quotas, idempotency, the audit trail and
the usage ledger."""
