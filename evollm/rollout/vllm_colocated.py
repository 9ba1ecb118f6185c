"""The in-process vLLM backend of :class:`evollm.rollout.vllm_engine.VLLMEngine` (``vllm.mode:
colocate``): one ``vllm.LLM`` sharing the device with training, each member a LoRA id, optional
sleep mode between rollouts. The server backend is :mod:`evollm.rollout.vllm_server`."""

from __future__ import annotations

from pathlib import Path


class ColocatedBackend:
    """An in-process ``vllm.LLM``."""

    def __init__(self, llm):
        self.llm = llm
        self.sleeping = False
        self.can_sleep = bool(getattr(llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False))

    def _request(self, name: str, registered: dict):
        from vllm.lora.request import LoRARequest

        reg = registered[name]
        return LoRARequest(name, reg.lora_id, str(reg.path))

    def add(self, name: str, lora_id: int, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        self._wake()
        if not self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, str(path))):
            raise RuntimeError(f"vLLM refused adapter {name} ({path})")

    def remove(self, lora_id: int) -> None:
        self.llm.llm_engine.remove_lora(lora_id)

    def _wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def _sleep(self) -> None:
        if self.can_sleep:
            self.llm.sleep(level=1)
            self.sleeping = True

    def generate(self, requests, registered: dict, params) -> list[list[tuple[list[int], list[float]]]]:
        """``params``: one dict of ``SamplingParams`` keywords for all requests, or one per request."""
        from vllm import SamplingParams

        self._wake()
        sampling = ([SamplingParams(**p) for p in params] if isinstance(params, (list, tuple))
                    else SamplingParams(**params))
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], sampling,
                                 lora_request=[self._request(name, registered) for _, name in requests],
                                 use_tqdm=False)
        self._sleep()
        result = []
        for out in outs:
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                lps = [_logprob_of(entry, t) for entry, t in zip(c.logprobs or [], tokens)]
                samples.append((tokens, lps))
            result.append(samples)
        return result

    def close(self) -> None:
        del self.llm


def _logprob_of(entry, token: int) -> float:
    """The log-prob of ``token`` from one position of vLLM's logprobs output."""
    value = entry[token]
    return float(getattr(value, "logprob", value))
