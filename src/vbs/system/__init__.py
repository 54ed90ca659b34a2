"""The operating system as VBS uses it: argv-only tool runs, facts about processes, the one daemon
supervisor, private files, socket paths, the desired-state store and logging set-up."""
