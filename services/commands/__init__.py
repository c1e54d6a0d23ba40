"""The operator's server-side `tollgate` subcommands, one module each: `up`, `infra` and
`reconcile`. Each parses its arguments and calls into the package that does the work
(`services.stack`, `services.ledger`)."""
