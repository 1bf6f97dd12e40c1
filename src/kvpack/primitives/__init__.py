"""Pure, stateless torch functions under every codec."""
