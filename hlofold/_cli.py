def main(argv=None):
    raise SystemExit("not yet")
