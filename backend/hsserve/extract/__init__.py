"""`hsserve extract`: the hidden states of a whole dataset into sharded safetensors, through a
running tritonserver or the engine in this process; `open_shards` reads them back."""

from hsserve.extract.shards import open_shards

__all__ = ["open_shards"]
