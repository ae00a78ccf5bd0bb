"""Launchers: how replica processes are started, watched and stopped, behind one interface
(``base.Launcher``). ``local`` runs subprocesses on this host."""
