__version__ = "1.14.0"  # MAJOR.MINOR is the protocol it speaks (messages.PROTOCOL_VERSION); PATCH: fixes only
