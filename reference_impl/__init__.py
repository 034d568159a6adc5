"""Reference implementation of sequence-parallel diffusion attention and the models around it."""
