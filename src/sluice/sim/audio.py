"""What an audio upload costs the simulator's engine, and the text it "hears".

vLLM 0.32 serves `/v1/audio/transcriptions` and `/v1/audio/translations` with an
encoder-decoder model such as Whisper (vllm/entrypoints/speech_to_text/base/serving.py,
vllm/model_executor/models/whisper.py): the audio is decoded, cut into windows of
`max_audio_clip_s` (30 s for Whisper) and each window is one engine request whose encoder
input is a fixed-size log-mel spectrogram (1500 encoder positions, Whisper's
`max_source_positions`, whatever the window's length) and whose decoder prompt is
`<|startoftranscript|><|lang|><|task|><|notimestamps|>` (4 tokens; `<|prev|>` and the
`prompt` text before it when one is given).

The simulator's rule, from that:
- duration: exact for a PCM WAV (RIFF header: data bytes / (rate x channels x bytes per
  sample)); for any other format, estimated from the upload's size at 16,000 bytes a second
  (128 kbit/s, a common bitrate for compressed speech);
- one engine request per 30 s window (the last one shorter), each holding
  1500 + its decoder prompt tokens of KV (the encoder output the decoder attends to, and
  the decoder prompt);
- each window's transcript is ceil(3 x its seconds) tokens, at least 1 (speech runs at
  about 150 words a minute, 2.5 words a second, ~1.3 tokens a word), capped by
  `max_completion_tokens`: deterministic, so the same upload always gets the same answer;
- the answer's usage is vLLM's: `{"type": "duration", "seconds": ceil(duration)}`, and in a
  stream `prompt_tokens` = decoder prompt + ceil(duration x 100) (vLLM's
  `get_num_audio_tokens`: 16 kHz over a 160-sample hop).
The words come from `tokens.WORDS`, starting at a place chosen by a hash of the upload.
An upload longer than vLLM's `VLLM_MAX_AUDIO_DECODE_DURATION_S` (600 s unless that variable
says otherwise) is refused with vLLM's message (vllm/multimodal/media/audio.py).
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass

from sluice.sim import tokens

WINDOW_S = 30.0  # Whisper's max_audio_clip_s
ENCODER_POSITIONS = 1500  # Whisper's max_source_positions
DECODER_PROMPT = 4  # <|startoftranscript|><|lang|><|task|><|notimestamps|>
COMPRESSED_BYTES_PER_S = 16_000
TOKENS_PER_S = 3.0
MEL_FRAMES_PER_S = 100  # 16 kHz sample rate / 160-sample hop
MAX_DURATION_ENV = "VLLM_MAX_AUDIO_DECODE_DURATION_S"


def max_duration_s() -> int:
    try:
        return int(os.environ.get(MAX_DURATION_ENV, "600"))
    except ValueError:
        return 600


def wav_duration(data: bytes) -> float | None:
    """The duration of a PCM WAV file, or None if `data` is not one."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos = 12
    byte_rate = 0
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        (size,) = struct.unpack("<I", data[pos + 4 : pos + 8])
        body = pos + 8
        if chunk_id == b"fmt " and size >= 16:
            _, channels, rate, byte_rate, _, bits = struct.unpack("<HHIIHH", data[body : body + 16])
            if not byte_rate:
                byte_rate = rate * channels * bits // 8
        elif chunk_id == b"data":
            if not byte_rate:
                return None
            size = min(size, len(data) - body)  # a truncated file: what is there
            return size / byte_rate
        pos = body + size + (size & 1)
    return None


def duration_of(data: bytes) -> float:
    wav = wav_duration(data)
    return wav if wav is not None else len(data) / COMPRESSED_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class Window:
    seconds: float
    prompt_tokens: int  # the engine request's KV: encoder positions + decoder prompt
    output_tokens: int  # its transcript's length before the max_tokens cap


@dataclass(frozen=True, slots=True)
class AudioCost:
    duration: float
    windows: tuple[Window, ...]
    decoder_prompt: int
    offset: int  # where its words start in tokens.WORDS

    @property
    def usage_seconds(self) -> int:
        return math.ceil(self.duration)

    @property
    def stream_prompt_tokens(self) -> int:
        return self.decoder_prompt + math.ceil(self.duration * MEL_FRAMES_PER_S)


def cost(data: bytes, prompt: str = "") -> AudioCost:
    """ValueError (vLLM's message) when the audio is longer than allowed."""
    duration = duration_of(data)
    limit = max_duration_s()
    if duration > limit:
        raise ValueError(
            f"Audio exceeds maximum allowed duration of {limit}s (metadata reports "
            f"{duration:.1f}s). Set {MAX_DURATION_ENV} to increase this limit."
        )
    decoder = DECODER_PROMPT + (1 + tokens.count_text_tokens(prompt) if prompt else 0)
    count = max(1, math.ceil(duration / WINDOW_S))
    windows = []
    for i in range(count):
        seconds = min(WINDOW_S, max(0.0, duration - i * WINDOW_S))
        out = max(1, math.ceil(TOKENS_PER_S * seconds))
        windows.append(Window(seconds, ENCODER_POSITIONS + decoder, out))
    return AudioCost(duration, tuple(windows), decoder, zlib.crc32(data) % len(tokens.WORDS))
