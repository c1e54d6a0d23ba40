from services.ledger.main import main

main()
