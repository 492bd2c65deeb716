"""The server: health, the SDK's client configuration, capabilities, telemetry."""

from litestar import Controller, Response, get, post

from adapters.http.tinker.deps import SdkConfig, Service
from adapters.http.tinker.replies import ok


class ServerRoutes(Controller):
    @get("/healthz")
    async def healthz(self) -> Response[bytes]:
        return ok({"status": "ok"})

    @post("/client/config", status_code=200)
    async def client_config(self, sdk_config: SdkConfig) -> Response[bytes]:
        return ok(sdk_config)

    @get("/get_server_capabilities")
    async def capabilities(self, service: Service) -> Response[bytes]:
        models = [
            {
                "model_name": m.name,
                "max_context_length": m.max_context_length,
                "trainable": m.trainable,
                "sampleable": m.sampleable,
            }
            for m in service.served_models()
        ]
        return ok({"supported_models": models})

    @post("/telemetry", status_code=200)
    async def telemetry(self) -> Response[bytes]:
        return ok({"status": "accepted"})
