"""Applications built on the plugin layer: `megatron-adapt demo`, LAMBADA evaluation and the pytest
plugin for Megatron's own unit tests. The core (`megatron_adapt`) never imports them."""
