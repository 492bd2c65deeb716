"""Ray Serve adapters: the engine replicas' deployment and its start and stop, the request
router that places calls on engine replicas by the domain's routing policy, and the
dispatcher that sends the ingress's calls through a deployment handle. Imported only with
``--replicas`` (Ray is not loaded otherwise)."""
