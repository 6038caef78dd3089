"""streamsan's tests, one package per folder (so that test modules of one name in two folders do not clash);
``tests/README.md`` maps them."""
