"""`POST /tokenize` and `POST /detokenize` (vllm/entrypoints/serve/tokenize/ in vLLM 0.32).
They cost the engine nothing. Ids come from `sim.tokenizer`, so a tokenized prompt is as
long as the generation routes count it and detokenizes back to its text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from sluice.sim import fields, tokenizer
from sluice.sim.openai_api import ApiError, bad_request
from sluice.sim.serving import error_response, json_response, read_json

if TYPE_CHECKING:
    from sluice.sim.server import SimServer


class TokenizeRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            ids = _tokenize(body)
            self.server.models_registry.resolve(body.get("model"))
        except ApiError as err:
            return error_response(err)
        strs = [tokenizer.token_str(t) for t in ids] if body.get("return_token_strs") else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.server.profile.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            ids = fields.required(body, "tokens")
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in ids
            ):
                raise fields.invalid("tokens", "Input should be a list of token ids", "list_type")
            self.server.models_registry.resolve(body.get("model"))
            try:
                text = tokenizer.decode(ids)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        except ApiError as err:
            return error_response(err)
        return json_response({"prompt": text})


def _tokenize(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise fields.invalid("messages", "Input should be a list of messages", "list_type")
        add_generation_prompt = fields.boolean(body, "add_generation_prompt", default=True)
        if add_generation_prompt and fields.boolean(body, "continue_final_message"):
            raise fields.invalid_value(
                "continue_final_message",
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        try:
            return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise fields.invalid("messages", str(exc)) from None
    prompt = fields.required(body, "prompt")
    if not isinstance(prompt, str):
        raise fields.invalid("prompt", "Input should be a valid string", "string_type")
    return tokenizer.encode_text(prompt)
