"""Reading a Prometheus text exposition (an engine's /metrics, the gateway's, a
simulator's) the way the bench and the tests do: one parse, three views."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# labels every vLLM series carries, left out of `parse_metrics`'s short keys
_ENGINE_LABELS = ("engine", "model_name")


def series(text: str) -> Series:
    """{(sample name, sorted labels): value}, one entry per series."""
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def first(m: Series, name: str) -> float | None:
    """The value of the first series named `name` (an engine's gauges have one), or None."""
    for (n, _), v in m.items():
        if n == name:
            return v
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """{key: value}. Keys: the bare sample name (summed over all label sets); `name{k="v",...}`
    with all labels in sorted order; and `name{k="v",...}` without the `engine` and
    `model_name` labels every vLLM series carries (summed), e.g.
    `vllm:request_success_total{finished_reason="abort"}`."""
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for (name, labels), value in series(text).items():
        add(name, value)
        if not labels:
            continue
        add(name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}", value)
        own = [(k, v) for k, v in labels if k not in _ENGINE_LABELS]
        if own and len(own) < len(labels):
            add(name + "{" + ",".join(f'{k}="{v}"' for k, v in own) + "}", value)
    return out


def gauge_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named samples, summed over label sets: a line scan, ten times cheaper than a full
    parse of vLLM's 60 kB of histograms (for sampling at 10 Hz)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, sep, _ = line.partition("{")
        if not sep:
            name = line.partition(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out
