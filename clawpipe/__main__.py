from clawpipe.cli import main

main()
