//! `hubsync demo`: two real hubs and six devices on loopback, end to end:
//! a group formed, messages, concurrent commits, a device restart, a hub
//! stopped, a procedure called over a tunnel, and a late joiner fetching
//! the group's history.

use hubsync::device::{Device, Event, EventStream, GroupId};
use hubsync::testkit::{device_options, open_sled, TestHub};
use hubsync::wire::DeviceId;
use std::collections::HashSet;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

struct Node {
    name: String,
    device: Device,
    dir: tempfile::TempDir,
    events: EventStream,
    seen: HashSet<[u8; 16]>,
    joined: HashSet<GroupId>,
}

impl Node {
    async fn open(name: &str, hubs: &[String], dir: tempfile::TempDir) -> Result<Node, String> {
        // A restarted device reopens its directory: wait for the previous
        // run's store to let go of its lock.
        let kv = open_sled(dir.path())
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        let device = Device::open_store(std::sync::Arc::new(kv), device_options(hubs))
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        let events = device.events();
        Ok(Node {
            name: name.to_string(),
            device,
            dir,
            events,
            seen: HashSet::new(),
            joined: HashSet::new(),
        })
    }

    fn drain(&mut self) {
        while let Some(got) = self.events.try_recv() {
            let Ok(e) = got else {
                println!("  {} missed some events", self.name);
                continue;
            };
            match e {
                Event::MessageReceived { id, body, .. } if self.seen.insert(id) => {
                    println!(
                        "  {} received {:?}",
                        self.name,
                        String::from_utf8_lossy(&body)
                    );
                }
                Event::GroupJoined { group, epoch } => {
                    self.joined.insert(group);
                    println!("  {} joined the group at epoch {epoch}", self.name);
                }
                _ => {}
            }
        }
    }
}

async fn until(nodes: &mut [Node], what: &str, pred: impl Fn(&Node) -> bool) -> Result<(), String> {
    let start = Instant::now();
    loop {
        for n in nodes.iter_mut() {
            n.drain();
        }
        if nodes.iter().all(&pred) {
            return Ok(());
        }
        if start.elapsed() > WAIT {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn converge(nodes: &[Node], g: GroupId) -> Result<u64, String> {
    let start = Instant::now();
    loop {
        let mut states = Vec::new();
        for n in nodes {
            let e = n.device.epoch(g).await.map_err(|e| e.to_string())?;
            let a = n
                .device
                .epoch_authenticator(g)
                .await
                .map_err(|e| e.to_string())?;
            states.push((e, a));
        }
        if states.windows(2).all(|w| w[0] == w[1]) {
            return Ok(states[0].0);
        }
        if start.elapsed() > WAIT {
            return Err("devices did not converge".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Run the demo; prints as it goes and ends with one summary line.
pub async fn run() -> Result<(), String> {
    let started = Instant::now();
    let h1 = TestHub::start().await.map_err(|e| e.to_string())?;
    let h2 = TestHub::start().await.map_err(|e| e.to_string())?;
    let hubs = vec![h1.url().to_string(), h2.url().to_string()];
    println!("hubs: {} (commit hub) and {}", hubs[0], hubs[1]);
    let mut nodes = Vec::new();
    for name in ["ada", "bo", "cy", "di", "eve"] {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        nodes.push(Node::open(name, &hubs, dir).await?);
        println!("device {name} opened");
    }
    let g = nodes[0]
        .device
        .create_group(&hubs)
        .await
        .map_err(|e| e.to_string())?;
    println!("ada created group {g} bound to both hubs");
    let ids: Vec<DeviceId> = nodes.iter().map(|n| n.device.id()).collect();
    for (i, id) in ids.iter().enumerate().skip(1) {
        loop {
            match nodes[0].device.invite(g, *id).await {
                Ok(r) => {
                    println!("ada invited {} (epoch {})", nodes[i].name, r.outcome.epoch);
                    break;
                }
                Err(hubsync::device::CommitError::NoKeyPackage(_)) if started.elapsed() < WAIT => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(format!("invite failed: {e}")),
            }
        }
    }
    until(&mut nodes[1..], "every invitee to join", |n| {
        n.joined.contains(&g)
    })
    .await?;
    converge(&nodes, g).await?;

    let mut sent = 0usize;
    for n in &nodes {
        n.device
            .send(g, format!("hello from {}", n.name).as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        sent += 1;
    }
    until(&mut nodes, "every hello", |n| n.seen.len() == 4).await?;

    println!("bo, cy and di commit at the same moment");
    let (r1, r2, r3) = tokio::join!(
        nodes[1].device.rotate_keys(g),
        nodes[2].device.rotate_keys(g),
        nodes[3].device.rotate_keys(g)
    );
    for r in [r1, r2, r3] {
        let r = r.map_err(|e| e.to_string())?;
        println!(
            "  a commit landed at epoch {} after {} build(s)",
            r.outcome.epoch, r.outcome.attempts
        );
    }
    let epoch = converge(&nodes, g).await?;
    println!("all five agree on epoch {epoch}");

    println!("restarting cy from its directory");
    let cy = nodes.remove(2);
    let (name, dir) = (cy.name.clone(), cy.dir);
    cy.device.close().await;
    drop(cy.device);
    let mut cy = Node::open(&name, &hubs, dir).await?;
    cy.seen = HashSet::new();
    nodes.insert(2, cy);
    nodes[0]
        .device
        .send(g, b"welcome back, cy")
        .await
        .map_err(|e| e.to_string())?;
    sent += 1;
    until(&mut nodes[2..3], "cy to hear ada", |n| !n.seen.is_empty()).await?;

    println!("stopping the second hub");
    h2.stop().await;
    for n in &nodes {
        n.device
            .send(g, format!("{} still here", n.name).as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        sent += 1;
    }
    // ada: 4 hellos + 4; cy (counting since its restart): ada's welcome + 4;
    // the others: 4 hellos + ada's welcome + 4.
    until(&mut nodes, "messages over the remaining hub", |n| {
        let want = match n.name.as_str() {
            "ada" => 8,
            "cy" => 5,
            _ => 9,
        };
        n.seen.len() >= want
    })
    .await?;
    converge(&nodes, g).await?;

    println!("bo serves a procedure; ada calls it over a tunnel");
    let bo_name = nodes[1].name.clone();
    nodes[1]
        .device
        .serve(
            hubsync::device::Procedures::new().unary("greet", move |caller, body| {
                let name = bo_name.clone();
                async move {
                    Ok(format!(
                        "{name} greets {} who said {:?}",
                        &caller.device.to_string()[..8],
                        String::from_utf8_lossy(&body)
                    )
                    .into_bytes())
                }
            }),
        );
    let tunnel = nodes[0]
        .device
        .open_tunnel(g, nodes[1].device.id())
        .await
        .map_err(|e| e.to_string())?;
    let answer = tunnel
        .call("greet", b"hi bo".to_vec())
        .await
        .map_err(|e| e.to_string())?;
    println!("  {}", String::from_utf8_lossy(&answer));
    tunnel.close();

    println!("ada lets members hand on the last 20 messages; fay joins late");
    nodes[0]
        .device
        .set_setting(g, hubsync::device::tunnel::history::SETTING, b"20")
        .await
        .map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let fay = Node::open("fay", &hubs[..1], dir).await?;
    loop {
        match nodes[0].device.invite(g, fay.device.id()).await {
            Ok(r) => {
                println!("ada invited fay (epoch {})", r.outcome.epoch);
                break;
            }
            Err(hubsync::device::CommitError::NoKeyPackage(_)) if started.elapsed() < 3 * WAIT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(format!("invite failed: {e}")),
        }
    }
    nodes.push(fay);
    until(&mut nodes[5..], "fay to join", |n| n.joined.contains(&g)).await?;
    let epoch = converge(&nodes, g).await?;
    let history = nodes[5]
        .device
        .sync_history(g)
        .await
        .map_err(|e| e.to_string())?;
    nodes[5].drain();
    println!(
        "  fay got {} messages of the group's history (of {} allowed) from a co-member",
        history.received, history.allowed
    );

    let delivered: u64 = nodes.iter().map(|n| n.device.stats().delivered).sum();
    let duplicates: u64 = nodes.iter().map(|n| n.device.stats().duplicates).sum();
    for n in &nodes {
        n.device.close().await;
    }
    h1.stop().await;
    println!(
        "demo: {} devices, 2 hubs, epoch {epoch}, {sent} messages sent, {delivered} delivered, {duplicates} duplicates suppressed, {:.1} s",
        nodes.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
