"""Small example reward functions, usable as `function: ppo_cli.examples.rewards:NAME`."""
