"""LiLiCorr: a DFlash block draft whose top-k candidates per slot a small correlator reranks along a lattice."""
