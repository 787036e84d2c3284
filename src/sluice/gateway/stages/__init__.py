"""The stages of the request path, in the order request_path.py runs them.

Each stage is a small object built once with what it needs (the key ring, the bridge,
the telemetry...) and one method that takes the request's RequestContext. A stage that
answers the request itself (a refusal, an error, a fallback) returns the response; one
that lets the request go on returns None. Each is tested on its own in
tests/unit/test_gateway_stages.py."""
