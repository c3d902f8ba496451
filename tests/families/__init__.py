"""Model families defined outside fitgpt, as a plugin would define one: each folder registers
its Family with fitgpt.model.families.register_family and touches nothing outside itself."""
