"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` (vLLM 0.32:
vllm/entrypoints/speech_to_text/): a multipart upload, relayed with its own Content-Type.

The gateway's cost rule for an upload (documented in docs/routes.md):
- duration: exact for a PCM WAV (its header: frames / rate, read by the stdlib `wave`);
  for any other format, from the upload's size at 16,000 bytes a second (128 kbit/s, the
  usual bitrate of compressed speech from phones and browsers); at most 600 s (vLLM's
  VLLM_MAX_AUDIO_DECODE_DURATION_S default: a longer upload is refused by the backend);
- Whisper-style engines cut the audio into 30 s windows and run one engine request per
  window, each holding the encoder's 1500 positions and a 4-token decoder prompt of KV:
  the request is `windows` sequences, prompt = windows x 1504 tokens;
- output: speech runs at about 3 tokens a second; each window may write up to 4 tokens a
  second of its audio (the request's `max_completion_tokens`, if it sets one, instead).
The answer's usage is a duration (`{"type": "duration", "seconds"}`), not tokens: the
estimate is what the quota is charged."""

from __future__ import annotations

import contextlib
import io
import math
import wave
from email.parser import BytesParser
from email.policy import HTTP

from multidict import CIMultiDictProxy

from sluice.gateway.request_body import BadRequest, ParsedRequest
from sluice.gateway.routes import bodies
from sluice.gateway.routes.openai_api import OPENAI_STREAM
from sluice.gateway.routes.spec import RouteSpec, StreamShape

WINDOW_S = 30.0
WINDOW_TOKENS = 1500 + 4  # encoder positions + decoder prompt, per window
COMPRESSED_BYTES_PER_S = 16_000
MAX_DURATION_S = 600.0
OUTPUT_TOKENS_PER_S = 4.0

# No usage event is asked for (the upload is relayed as sent): the stream's refusal is
# read as chat's.
AUDIO_STREAM = StreamShape(usage_marker=b'"usage":{', refusal_prefix=OPENAI_STREAM.refusal_prefix)


def audio_duration(data: bytes) -> float:
    """Seconds of audio in an upload, by the rule above."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        with (
            contextlib.suppress(wave.Error, EOFError, ValueError),
            wave.open(io.BytesIO(data)) as w,
        ):
            rate = w.getframerate()
            if rate > 0:
                return min(MAX_DURATION_S, w.getnframes() / rate)
    return min(MAX_DURATION_S, len(data) / COMPRESSED_BYTES_PER_S)


def _form(raw: bytes, content_type: str) -> tuple[dict[str, str], bytes]:
    """The text fields and the file of a multipart/form-data body."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest("an audio upload must be multipart/form-data with a 'file' part")
    head = b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n"
    message = BytesParser(policy=HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise BadRequest("the multipart body could not be read")
    fields: dict[str, str] = {}
    upload: bytes | None = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):  # a part without a body (decode=True gives bytes)
            payload = b""
        if name == "file":
            upload = payload
        elif isinstance(name, str):
            fields[name] = payload.decode("utf-8", "replace")
    if upload is None:
        raise BadRequest("the upload has no 'file' part")
    return fields, upload


def parse_audio(raw: bytes, headers: CIMultiDictProxy[str]) -> ParsedRequest:
    fields, upload = _form(raw, headers.get("Content-Type", ""))
    model = fields.get("model", "").strip()
    if not model:
        raise BadRequest("'model' is required")
    stream = fields.get("stream", "").strip().lower() in ("true", "1")
    duration = audio_duration(upload)
    windows = max(1, math.ceil(duration / WINDOW_S))
    max_tokens = max(1, math.ceil(OUTPUT_TOKENS_PER_S * duration / windows))
    asked = fields.get("max_completion_tokens", "").strip()
    if asked.isdigit() and int(asked) > 0:
        max_tokens = int(asked)
    return bodies.parsed(
        {"model": model},
        model,
        windows * WINDOW_TOKENS,
        stream=stream,
        max_tokens=max_tokens,
        sequences=windows,
    )


def _route(name: str, path: str) -> RouteSpec:
    return RouteSpec(name, path, parse_audio, stream=AUDIO_STREAM, client_content_type=True)


TRANSCRIPTIONS = _route("transcriptions", "/v1/audio/transcriptions")
TRANSLATIONS = _route("translations", "/v1/audio/translations")
