"""reef-skillclaw: SkillClaw: collective evolution of the agent's skills from graded sessions."""
