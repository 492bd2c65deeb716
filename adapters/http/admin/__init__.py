"""The admin face.

- ``GET /admin/replicas``: a fleet's engine replicas (id, pid, node, state, running,
  waiting, KV usage, prefix hit rate), served when the server runs replicas. Behind the API
  keys when there are any (any key; open without a keys file).
- ``/admin/tenants``: tenants (their faces, models, weight and limits) and their API keys,
  created, changed and revoked at run time in the keys file (admin keys only).
- ``/admin/rollouts``: rollouts (a model name split between served models by weight and
  tenant: canaries, moved and rolled back at run time). Admin keys only (the ``admin``
  face; open without a keys file); every change an audit line (logger ``infer.audit``).
- ``GET /admin/audit``: those changes, kept in the audit trail (admin keys only).
- ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` (vLLM's) and
  ``GET /admin/lora_adapters``: LoRA adapters served from a folder at run time (admin keys
  only; each change stored and audited).
"""

from adapters.http.admin.audit import audit_router
from adapters.http.admin.guard import admin_caller
from adapters.http.admin.lora import lora_router
from adapters.http.admin.replicas import admin_router
from adapters.http.admin.rollouts import rollout_router
from adapters.http.admin.tenants import tenant_router

__all__ = [
    "admin_caller",
    "admin_router",
    "audit_router",
    "lora_router",
    "rollout_router",
    "tenant_router",
]
