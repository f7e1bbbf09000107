"""Communication: counted collectives (ops, ledger) and the plain gather/reduce strategies."""
