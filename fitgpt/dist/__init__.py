from fitgpt.dist.context import DistContext, init_distributed, pick_device, shutdown

__all__ = ["DistContext", "init_distributed", "pick_device", "shutdown"]
