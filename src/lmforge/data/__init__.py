"""Everything before the model sees a token: readers, tokenizer, token shards, loader."""
