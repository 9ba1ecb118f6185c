"""configs/deepspeed/*.yaml are valid accelerate configs for a DeepSpeed ZeRO launch (checked with
accelerate's own config classes, and with DeepSpeed's config checks when DeepSpeed is installed)."""

from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"


@pytest.mark.parametrize("name,stage", [("zero1.yaml", 1), ("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_deepspeed_accelerate_config_is_valid(name, stage):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    cfg = ClusterConfig.from_yaml_file(str(CONFIGS / name))
    assert cfg.distributed_type == DistributedType.DEEPSPEED and not cfg.use_cpu
    ds = dict(cfg.deepspeed_config)
    assert ds["zero_stage"] == stage
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    plugin = DeepSpeedPlugin(zero_stage=ds["zero_stage"], gradient_clipping=ds["gradient_clipping"],
                             gradient_accumulation_steps=ds["gradient_accumulation_steps"],
                             offload_optimizer_device=ds["offload_optimizer_device"],
                             offload_param_device=ds["offload_param_device"], zero3_init_flag=ds["zero3_init_flag"])
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == stage
    assert config["gradient_clipping"] == 1.0
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return  # DeepSpeed not installed: accelerate's checks above are what can run here
    resolved = {**config, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 1}
    DeepSpeedConfig(resolved)  # raises on an invalid configuration (one process: world size 1)


def test_launch_reads_the_zero_stage(monkeypatch):
    from evollm.parallel import distributed as dist

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert dist.zero_stage() is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert dist.zero_stage() == 3
