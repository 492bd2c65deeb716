"""vLLM's runtime LoRA endpoints on the fake backend: admin keys only (401 / 403 in OpenAI's
format), and a server without LoRA serving says how to turn it on. (Loading, serving,
keeping and unloading real adapters: tests/integration/http/test_lora_models_http.py.)"""

import json
from pathlib import Path

from litestar.testing import TestClient

from application.access.keys import hash_key
from tests.fakes import fake_container


def test_only_admin_keys_load_and_unload_adapters(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    tenants = [
        {"id": "ops", "keys": [hash_key("sk-ops")], "faces": ["openai", "admin"]},
        {"id": "user", "keys": [hash_key("sk-user")]},
    ]
    keys.write_text(json.dumps({"tenants": tenants}))
    container = fake_container(cache_dir=str(tmp_path), api_keys_file=str(keys))
    body = {"lora_name": "sql", "lora_path": str(tmp_path)}
    with TestClient(app=container.http_app()) as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            missing = http.post(path, json=body)
            assert missing.status_code == 401 and "error" in missing.json()
            user = http.post(path, json=body, headers={"Authorization": "Bearer sk-user"})
            assert user.status_code == 403, user.text
        admin = {"Authorization": "Bearer sk-ops"}
        off = http.post("/v1/load_lora_adapter", json=body, headers=admin)
        assert off.status_code == 400
        assert "--enable-lora" in off.json()["error"]["message"]
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "The LoRA adapter `sql` cannot be found"
        listed = http.get("/admin/lora_adapters", headers=admin).json()
        assert listed == {"object": "list", "data": []}
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
