"""ppo_cli: PPO (RLHF) fine-tuning from YAML recipes."""

__version__ = "0.1.0"
