"""``vllm.mode: server``: the population's rollouts on a running ``vllm serve`` (OpenAI-compatible HTTP).

Start the server on the base model with LoRA and runtime adapter loading, the trainer's dtype and
processed log-probs (the log-probs of the distribution actually sampled, as the colocated engine)::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server --model BASE \\
        --enable-lora --max-loras 8 --max-lora-rank 16 --dtype float32 --logprobs-mode processed_logprobs

Every member is a LoRA adapter the server loads at run time (``/v1/load_lora_adapter``, from the
folder the engine writes: the server must see the same filesystem) and drops
(``/v1/unload_lora_adapter``). Every prompt row is one ``/v1/completions`` request with the prompt's
token ids, ``n`` samples, its own ``seed``, and ``logprobs=0`` (the sampled token's log-prob), sent
concurrently so that the server batches them. Token ids come back as ``token_id:N``
(``return_tokens_as_token_ids``). The integrity check of :class:`~evollm.rollout.vllm_engine.VLLMEngine`
runs on what the server returns, as in colocate mode.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: SamplingParams keywords evollm sets that the completions API does not take (tokens only, no text)
_NOT_SENT = ("detokenize",)


class ServerBackend:
    """The engine backend of ``vllm.mode: server`` (same interface as the colocated one)."""

    def __init__(self, url: str, timeout: float = 600.0, max_concurrency: int = 64):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_concurrency = max_concurrency
        self.served: dict[int, str] = {}  # lora id -> the adapter's name on the server
        try:
            models = self._request("GET", "/v1/models")
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"vllm.server_url={url!r}: no vLLM server answers there ({e}); start `python -m "
                                  "vllm.entrypoints.openai.api_server --model BASE --enable-lora ...` first") from None
        self.model = models["data"][0]["id"]

    def _request(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {self.url}{path}: HTTP {e.code}: {e.read().decode()[:500]}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def add(self, name: str, lora_id: int, path: Path) -> None:
        served = f"{name}-{lora_id}"
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(path)})
        self.served[lora_id] = served

    def remove(self, lora_id: int) -> None:
        served = self.served.pop(lora_id, None)
        if served is not None:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": served})

    def generate(self, requests, registered: dict, params) -> list[list[tuple[list[int], list[float]]]]:
        """``params``: one dict of ``SamplingParams`` keywords for all requests, or one per request."""
        per_request = params if isinstance(params, (list, tuple)) else [params] * len(requests)
        bodies = []
        for (ids, name), p in zip(requests, per_request):
            body = {k: v for k, v in p.items() if k not in _NOT_SENT}
            body.update(model=self.served[registered[name].lora_id], prompt=list(ids),
                        return_tokens_as_token_ids=True, logprobs=0)
            bodies.append(body)
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(bodies)))) as pool:
            outs = list(pool.map(lambda b: self._request("POST", "/v1/completions", b), bodies))
        result = []
        for out in outs:
            samples = []
            for choice in sorted(out["choices"], key=lambda c: c["index"]):
                lp = choice.get("logprobs") or {}
                tokens = [int(t.rsplit(":", 1)[1]) for t in lp.get("tokens") or []]
                samples.append((tokens, [float(x) for x in lp.get("token_logprobs") or []]))
            result.append(samples)
        return result

    def close(self) -> None:
        for lora_id in list(self.served):
            try:
                self.remove(lora_id)
            except (RuntimeError, OSError):
                pass
