from dpfleet.cli import main

main()
