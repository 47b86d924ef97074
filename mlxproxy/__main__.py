from mlxproxy.cli import main

main()
