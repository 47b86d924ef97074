from mlxproxy.cli import main

main(prog_name="mlxproxy")
