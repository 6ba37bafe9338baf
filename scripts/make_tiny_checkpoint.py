"""Write a random tiny DeepSeek-V3.2 checkpoint; see ``--help``."""

from sglang_echo.tools.tiny_checkpoint import main

if __name__ == "__main__":
    main()
