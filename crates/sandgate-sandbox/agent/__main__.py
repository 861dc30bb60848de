"""`python3 -u <this directory or the agent archive> [kernel]`: runs the sandbox agent (the
container runs it through bootstrap.py instead, which finds the archive on its command line)."""

from sandgate_agent.main import main

main()
