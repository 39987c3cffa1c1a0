"""Data: corpora -> tokenizer -> llm.c token shards -> batches.

    corpus.py     open_corpus("pystdlib" | "tinystories" | path): lazy (split, Document) stream
    tokenizer.py  Tokenizer (byte-level BPE, HF tokenizers), ByteTokenizer, load_tokenizer(path)
    shards.py     write_shard / read_shard / ShardWriter: the llm.c .bin layout
    prepare.py    prepare(corpus, out_dir, vocab_size) -> meta; default_data_dir(); load_meta()
    loader.py     TokenLoader(pattern, B, T, rank, world_size, seed): next_batch() -> int64 [B, T+1]
    cli.py        `xtrain data prepare|info`

Nothing is imported here, so `xtrain data` starts without loading torch.
"""
