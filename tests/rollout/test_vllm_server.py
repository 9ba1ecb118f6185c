"""vllm.mode=server: a running vLLM OpenAI-compatible server with runtime LoRA loading serves the
population as the colocated engine does (vLLM stage; skipped without vLLM)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from vllm_support import requires_vllm, tiny_vllm_model

pytestmark = requires_vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = os.environ.get("EVOLLM_CACHE") or str(tmp_path_factory.mktemp("cache"))
    model, tok = tiny_vllm_model(cache, warm_start=False)
    folder = model.config._name_or_path
    port = _free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                             "--port", str(port), "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8",
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
                             "--logprobs-mode", "processed_logprobs"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("vLLM server did not start in 300 s")
        yield url, model, tok
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _served_names(url):
    with urllib.request.urlopen(url + "/v1/models") as r:
        return sorted(m["id"] for m in json.loads(r.read())["data"][1:])


def test_server_mode_serves_what_the_colocated_engine_serves(server):
    from evollm.algorithms.grpo import GRPO
    from evollm.rollout import collate_prompts
    from evollm.rollout.vllm_engine import VLLMEngine

    url, model, tok = server
    torch.manual_seed(0)
    pop = GRPO.population(2, actor_network=model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          group_size=4, max_output_tokens=6)
    for a in pop:
        for p in a.shared.parameters(a.adapter_name()):
            torch.nn.init.normal_(p, std=0.15)
    rows = [torch.tensor([3, 10, 11, 12, 4]), torch.tensor([3, 13, 4])]
    ids, mask = collate_prompts([{"input_ids": r} for r in rows], 0)
    local = VLLMEngine(pop[0].shared, {"max_model_len": 64}, max_rank=8, population_size=2)
    remote = VLLMEngine(pop[0].shared, {"mode": "server", "server_url": url}, max_rank=8, population_size=2)

    def sample(engine, training):
        torch.manual_seed(3)
        return engine.generate_for_members(pop, torch.cat([ids, ids]), torch.cat([mask, mask]), [2, 2],
                                           pop[0].sampling_config(training, group_size=4), tok.pad_token_id,
                                           tok.eos_token_id)

    def same():
        for training in (True, False):
            (s1, l1), (s2, l2) = sample(local, training), sample(remote, training)
            assert torch.equal(s1, s2), training  # the same tokens (sampled with the same seeds; greedy)
            torch.testing.assert_close(l1, l2, atol=1e-4, rtol=0)  # the same sampled-token log-probs

    try:
        same()
        assert _served_names(url) == sorted(f"{a.adapter_name()}-{remote.lora_id(a.adapter_name())}" for a in pop)
        assert remote.stats["integrity_checks"] > 0 and remote.stats["integrity_max_diff"] < 1e-3
        before = remote.lora_id(pop[0].adapter_name())
        with torch.no_grad():  # a learn step's worth of change on member 0 only
            for p in pop[0].shared.parameters(pop[0].adapter_name()):
                p.add_(0.05)
        same()
        assert remote.lora_id(pop[0].adapter_name()) != before  # re-registered under a new id, old one unloaded
        remote.release(pop[1].adapter_name())
        assert _served_names(url) == [f"{pop[0].adapter_name()}-{remote.lora_id(pop[0].adapter_name())}"]
    finally:
        local.close()
        remote.close()
