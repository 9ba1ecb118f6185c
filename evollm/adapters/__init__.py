"""The one shared base model and its members' LoRA adapters."""

from .resize import resize_adapter, svd_truncate
from .routing import routed
from .shared import SharedBase, default_lora_config

__all__ = ["SharedBase", "default_lora_config", "resize_adapter", "routed", "svd_truncate"]
