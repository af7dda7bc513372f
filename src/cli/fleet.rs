//! `outpost fleet status`: the devices on the fleet broker (see
//! `fleet/status.rs`).

use std::time::Duration;

use anyhow::{Context, bail};

use crate::fleet::status::Fleet;

#[derive(Debug, clap::Subcommand)]
pub enum FleetCommand {
    /// Devices seen on the fleet broker: retained online/offline status,
    /// model versions and last OTA step from what they publish while listening.
    Status(StatusArgs),
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// The fleet broker, HOST:PORT (MQTT 3.1.1, plain TCP).
    #[arg(long)]
    pub broker: String,
    /// First topic level of the devices' topics (`outpost/{device}/...`).
    #[arg(long, default_value = "outpost")]
    pub prefix: String,
    /// How long to listen after subscribing (retained status comes at once;
    /// versions and OTA steps as devices publish).
    #[arg(long, default_value = "3s", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub listen: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: &FleetCommand) -> anyhow::Result<()> {
    match cmd {
        FleetCommand::Status(a) => status(a),
    }
}

fn status(a: &StatusArgs) -> anyhow::Result<()> {
    let (host, port) = a
        .broker
        .rsplit_once(':')
        .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_string(), p)))
        .with_context(|| format!("--broker `{}`: expected HOST:PORT", a.broker))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fleet = rt.block_on(listen(host, port, a))?;
    if a.json {
        let devices: Vec<_> = fleet.devices.values().collect();
        println!("{}", serde_json::to_string_pretty(&devices)?);
    } else {
        print!("{}", fleet.table());
    }
    if fleet.unreadable > 0 {
        eprintln!("{} message(s) could not be read", fleet.unreadable);
    }
    Ok(())
}

async fn listen(host: String, port: u16, a: &StatusArgs) -> anyhow::Result<Fleet> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let mut fleet = Fleet::new(&a.prefix);
    let id = format!("outpost-fleet-status-{}", std::process::id());
    let mut o = MqttOptions::new(id, host, port);
    o.set_clean_session(true)
        .set_keep_alive(Duration::from_secs(10))
        .set_max_packet_size(1 << 20, 16 << 20);
    let (client, mut ev) = AsyncClient::new(o, 16);
    client.subscribe(fleet.filter(), QoS::AtMostOnce).await?;
    let connect_by = tokio::time::Instant::now() + Duration::from_secs(10);
    // Until SUBACK: connection errors are fatal.
    loop {
        match tokio::time::timeout_at(connect_by, ev.poll()).await {
            Err(_) => bail!("no SUBACK from {} within 10 s", a.broker),
            Ok(Err(e)) => bail!("fleet broker {}: {e}", a.broker),
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => fleet.observe(&p.topic, &p.payload),
            Ok(Ok(_)) => {}
        }
    }
    eprintln!("listening on {} for {:?}", fleet.filter(), a.listen);
    let until = tokio::time::Instant::now() + a.listen;
    loop {
        match tokio::time::timeout_at(until, ev.poll()).await {
            Err(_) => break,
            Ok(Err(e)) => bail!("fleet broker {}: {e}", a.broker),
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => fleet.observe(&p.topic, &p.payload),
            Ok(Ok(_)) => {}
        }
    }
    let _ = client.disconnect().await;
    Ok(fleet)
}
