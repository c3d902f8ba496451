"""Functions applied to a built model from outside, by both engines; the model files know nothing.

build.py builds the model both engines train, in one order: the family's network on the meta
device, the tensor- or context-parallel cut (fitgpt/parallel), then this rank's weights,
initialised or read, with tp_state.py carrying tensor-parallel state in and out (initialisation
by name, the gradient norm over the TP group, checkpoints in the unsplit layout). The engines then
apply compile.py (regional torch.compile, with norm.py's LayerNorms through ATen and wgrad.py's
weight gradients accumulated by their matrix product) and activation.py (activation
checkpointing, the kept block inputs on the device or in host RAM). This wing imports only the
engine's top level (layout, state_io) and the model, parallel and dist packages.
"""
