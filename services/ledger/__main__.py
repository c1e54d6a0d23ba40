from services.core.parent import follow_parent

follow_parent()

from services.ledger.app import main  # noqa: E402

main()
