//! `outpost outbox stats|export|purge --data-dir DIR`.

#[derive(Debug, clap::Subcommand)]
pub enum OutboxCommand {}

pub fn run(_cli: &super::Cli, cmd: &OutboxCommand) -> anyhow::Result<()> {
    match *cmd {}
}
