//! `hubsync device`: a real device driven from the terminal, so people and
//! test harnesses in any language can run one against real hubs. Every
//! command opens the device from its directory, does one thing, makes sure
//! what it queued has reached the hubs (or says it has not), and closes it.
//! Output is JSON, one object per line, on stdout; errors go to stderr with
//! a non-zero exit.

use clap::Subcommand;
use hubsync::device::{Device, DeviceOptions, Event, GroupId};
use hubsync::wire::DeviceId;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct DeviceArgs {
    /// The device's directory (created when missing): its identity, groups,
    /// outbox and inbox.
    #[arg(long)]
    data: PathBuf,
    /// A hub of the device's own (`ws://` to loopback, or `wss://`);
    /// repeat for several.
    #[arg(long = "hub", required = true)]
    hubs: Vec<String>,
    /// Seconds to wait, after a command, for what it queued to reach the
    /// hubs.
    #[arg(long, default_value_t = 10)]
    drain_secs: u64,
    #[command(subcommand)]
    op: DeviceOp,
}

#[derive(Subcommand)]
enum DeviceOp {
    /// Print this device's id: `{"device": HEX}`.
    Id,
    /// Wait until the device can be invited (its key packages are on its
    /// hubs): `{"ready": true}`.
    Ready {
        /// Seconds to wait at most.
        #[arg(long, default_value_t = 20)]
        secs: u64,
    },
    /// Create a group on the device's hubs: `{"group": HEX}`.
    CreateGroup,
    /// Invite a device into a group (admins only): `{"epoch": N}`.
    Invite {
        /// The group (hex).
        group: String,
        /// The device to invite (hex).
        device: String,
    },
    /// Remove a device from a group (admins only): `{"epoch": N}`.
    Remove {
        /// The group (hex).
        group: String,
        /// The device to remove (hex).
        device: String,
    },
    /// Send a text message to a group: `{"id": HEX, "epoch": N}`.
    Send {
        /// The group (hex).
        group: String,
        /// The message (UTF-8).
        text: String,
    },
    /// A group's members: `{"members": [HEX, ...]}`.
    Members {
        /// The group (hex).
        group: String,
    },
    /// The groups this device is in: `{"groups": [HEX, ...]}`.
    Groups,
    /// Print what happens as JSON lines (`"event"` names the kind) until
    /// killed or `--secs` pass. Every message not yet processed is printed
    /// first, from the durable inbox; a printed message is marked
    /// processed, so a listener restarted prints each message at least
    /// once and, unless killed between printing and marking, exactly once.
    Listen {
        /// Stop after this many seconds.
        #[arg(long)]
        secs: Option<u64>,
    },
}

fn group_arg(s: &str) -> Result<GroupId, String> {
    let bytes = hex::decode(s).map_err(|_| format!("not a group id (hex): {s}"))?;
    let id: [u8; 32] = bytes
        .try_into()
        .map_err(|_| format!("a group id is 32 bytes (64 hex characters): {s}"))?;
    Ok(GroupId(id))
}

fn device_arg(s: &str) -> Result<DeviceId, String> {
    DeviceId::from_hex(s).ok_or_else(|| format!("not a device id (64 hex characters): {s}"))
}

fn print(v: Value) {
    println!("{v}");
}

/// Run one `hubsync device` command.
pub async fn run(args: DeviceArgs) -> Result<(), String> {
    std::fs::create_dir_all(&args.data)
        .map_err(|e| format!("cannot create {}: {e}", args.data.display()))?;
    let device = Device::open(&args.data, DeviceOptions::new(args.hubs.clone()))
        .await
        .map_err(|e| e.to_string())?;
    let result = command(&device, &args.hubs, args.op).await;
    let drained = drain(&device, Duration::from_secs(args.drain_secs)).await;
    device.close().await;
    result?;
    if let Err(owed) = drained {
        eprintln!(
            "warning: {owed} publishes still owed to the hubs; they go out the next time this device runs"
        );
    }
    Ok(())
}

async fn command(device: &Device, hubs: &[String], op: DeviceOp) -> Result<(), String> {
    match op {
        DeviceOp::Id => print(json!({ "device": device.id().to_string() })),
        DeviceOp::Ready { secs } => {
            device
                .ready_for_invites(Duration::from_secs(secs))
                .await
                .map_err(|e| e.to_string())?;
            print(json!({ "ready": true }));
        }
        DeviceOp::CreateGroup => {
            let g = device.create_group(hubs).await.map_err(|e| e.to_string())?;
            print(json!({ "group": g.to_string() }));
        }
        DeviceOp::Invite { group, device: who } => {
            let g = group_arg(&group)?;
            device
                .invite(g, device_arg(&who)?)
                .await
                .map_err(|e| e.to_string())?;
            print(json!({ "epoch": device.epoch(g).await.map_err(|e| e.to_string())? }));
        }
        DeviceOp::Remove { group, device: who } => {
            let g = group_arg(&group)?;
            device
                .remove(g, device_arg(&who)?)
                .await
                .map_err(|e| e.to_string())?;
            print(json!({ "epoch": device.epoch(g).await.map_err(|e| e.to_string())? }));
        }
        DeviceOp::Send { group, text } => {
            let sent = device
                .send(group_arg(&group)?, text.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            print(json!({ "id": hex::encode(sent.id), "epoch": sent.epoch }));
        }
        DeviceOp::Members { group } => {
            let members = device
                .members(group_arg(&group)?)
                .await
                .map_err(|e| e.to_string())?;
            let members: Vec<String> = members.iter().map(ToString::to_string).collect();
            print(json!({ "members": members }));
        }
        DeviceOp::Groups => {
            let groups = device.groups().map_err(|e| e.to_string())?;
            let groups: Vec<String> = groups.iter().map(ToString::to_string).collect();
            print(json!({ "groups": groups }));
        }
        DeviceOp::Listen { secs } => listen(device, secs.map(Duration::from_secs)).await?,
    }
    Ok(())
}

/// Wait until the outbox owes the hubs nothing, or `within` passed
/// (answering what is still owed).
async fn drain(device: &Device, within: Duration) -> Result<(), usize> {
    let until = tokio::time::Instant::now() + within;
    loop {
        let owed = device.stats().outbox_owed;
        if owed == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= until {
            return Err(owed);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn listen(device: &Device, secs: Option<Duration>) -> Result<(), String> {
    // Subscribe before reading the inbox, so nothing falls between the two;
    // positions tell what was printed already.
    let mut events = device.events();
    let mut printed: BTreeMap<GroupId, u64> = BTreeMap::new();
    print_unprocessed(device, &mut printed)?;
    let stop = async {
        match secs {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(stop);
    loop {
        let e = tokio::select! {
            _ = &mut stop => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
            e = events.recv() => e,
        };
        match e {
            Some(Ok(Event::MessageReceived {
                group,
                position,
                sender,
                id,
                body,
            })) => {
                if printed.get(&group).is_some_and(|p| position <= *p) {
                    continue;
                }
                print(message_json(group, position, sender, id, &body));
                device
                    .mark_processed(group, position)
                    .map_err(|e| e.to_string())?;
                printed.insert(group, position);
            }
            Some(Ok(other)) => print(event_json(&other)),
            // Events were missed; the messages among them are in the inbox.
            Some(Err(lag)) => {
                print(json!({ "event": "lagged", "missed": lag.missed }));
                print_unprocessed(device, &mut printed)?;
            }
            None => return Ok(()),
        }
    }
}

/// Print every inbox message of every group past what `printed` (or the
/// inbox's processed mark) says, and mark it processed.
fn print_unprocessed(device: &Device, printed: &mut BTreeMap<GroupId, u64>) -> Result<(), String> {
    for g in device.groups().map_err(|e| e.to_string())? {
        let processed = device.inbox_status(g).map_err(|e| e.to_string())?.processed;
        let mut after = printed.get(&g).copied().unwrap_or(0).max(processed);
        loop {
            let page = device.messages(g, after, 256).map_err(|e| e.to_string())?;
            let Some(last) = page.last().map(|m| m.position) else {
                break;
            };
            for m in page {
                print(message_json(g, m.position, m.sender, m.id, &m.body));
            }
            device.mark_processed(g, last).map_err(|e| e.to_string())?;
            after = last;
        }
        printed.insert(g, after);
    }
    Ok(())
}

fn message_json(g: GroupId, position: u64, sender: DeviceId, id: [u8; 16], body: &[u8]) -> Value {
    json!({
        "event": "message",
        "group": g.to_string(),
        "position": position,
        "sender": sender.to_string(),
        "id": hex::encode(id),
        "text": String::from_utf8_lossy(body),
        "body_hex": hex::encode(body),
    })
}

fn event_json(e: &Event) -> Value {
    match e {
        Event::GroupJoined { group, epoch } => {
            json!({ "event": "joined", "group": group.to_string(), "epoch": epoch })
        }
        Event::MembersChanged { group, members } => json!({
            "event": "members",
            "group": group.to_string(),
            "members": members.iter().map(ToString::to_string).collect::<Vec<_>>(),
        }),
        Event::EpochChanged { group, epoch } => {
            json!({ "event": "epoch", "group": group.to_string(), "epoch": epoch })
        }
        Event::Removed { group } => json!({ "event": "removed", "group": group.to_string() }),
        other => json!({ "event": "other", "debug": format!("{other:?}") }),
    }
}
