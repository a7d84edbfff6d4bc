"""Prefix sharing: the sequences of one call that share a prefix are scored in one tree row
``[prefix, c1, .., cG]``, the prefix computed once, with an attention that gives exactly what
each sequence gives alone (``trie`` finds the prefixes, ``layout`` lays the row out,
``attention`` computes it, ``check`` proves it at load). docs/executor.md, *Shared prefixes*."""
