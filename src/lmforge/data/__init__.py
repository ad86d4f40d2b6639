"""What training reads: tokenizer, token shards, packed loader, mixtures; sources via corpus readers."""
