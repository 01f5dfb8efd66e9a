"""One module per `kvtier` subcommand; see kvtier.cli for the contract."""
