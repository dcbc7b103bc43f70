"""The `infinity` command line. One module per subcommand."""
