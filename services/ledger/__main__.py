from services.core.infra_process import follow_parent

follow_parent()

from services.ledger.main import main  # noqa: E402

main()
