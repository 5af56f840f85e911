//! What the agent knows about the node's network: its addresses, and which source address
//! the kernel picks toward a destination.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// Every address configured on the node's interfaces.
pub fn node_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return out;
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: walking the list getifaddrs returned.
        let a = unsafe { (*p).ifa_addr };
        if !a.is_null() {
            // SAFETY: the family tells which sockaddr it is.
            match unsafe { (*a).sa_family } as i32 {
                libc::AF_INET => {
                    // SAFETY: AF_INET means sockaddr_in.
                    let s = unsafe { &*(a as *const libc::sockaddr_in) };
                    out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))));
                }
                libc::AF_INET6 => {
                    // SAFETY: AF_INET6 means sockaddr_in6.
                    let s = unsafe { &*(a as *const libc::sockaddr_in6) };
                    out.push(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)));
                }
                _ => {}
            }
        }
        // SAFETY: as above.
        p = unsafe { (*p).ifa_next };
    }
    // SAFETY: frees what getifaddrs allocated.
    unsafe { libc::freeifaddrs(ifa) };
    out
}

static CACHE: std::sync::Mutex<Option<(std::time::Instant, Vec<IpAddr>)>> = std::sync::Mutex::new(None);

/// The node's addresses, refreshed at most once a second.
pub fn cached_addrs() -> Vec<IpAddr> {
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    match &*c {
        Some((t, v)) if t.elapsed() < std::time::Duration::from_secs(1) => v.clone(),
        _ => {
            let v = node_addrs();
            *c = Some((std::time::Instant::now(), v.clone()));
            v
        }
    }
}

/// True if `ip` is this node.
pub fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || cached_addrs().contains(&ip)
}

/// How long [`source_for`] keeps an answer: a node making thousands of connections a
/// second asks the kernel about each destination a few times a second, not once per
/// connection, while a route that changes (a network going down) is seen within this time.
const SOURCE_TTL: std::time::Duration = std::time::Duration::from_millis(100);

/// Most destinations whose source address is kept.
const SOURCE_KEPT: usize = 256;

static SOURCES: std::sync::Mutex<Vec<(IpAddr, std::time::Instant, IpAddr)>> =
    std::sync::Mutex::new(Vec::new());

/// The source address the kernel would use toward `dst` (asked at most every
/// [`SOURCE_TTL`] per destination).
pub fn source_for(dst: IpAddr) -> Option<IpAddr> {
    let now = std::time::Instant::now();
    {
        let kept = SOURCES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, _, src)) =
            kept.iter().find(|(d, t, _)| *d == dst && now.duration_since(*t) < SOURCE_TTL)
        {
            return Some(src);
        }
    }
    let src = source_for_now(dst)?;
    let mut kept = SOURCES.lock().unwrap_or_else(|e| e.into_inner());
    kept.retain(|(d, t, _)| *d != dst && now.duration_since(*t) < SOURCE_TTL);
    if kept.len() < SOURCE_KEPT {
        kept.push((dst, now, src));
    }
    Some(src)
}

/// [`source_for`], asking the kernel.
fn source_for_now(dst: IpAddr) -> Option<IpAddr> {
    if dst.is_loopback() || dst.is_unspecified() {
        return Some(if dst.is_ipv4() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            IpAddr::V6(Ipv6Addr::LOCALHOST)
        });
    }
    let bind: SocketAddr = if dst.is_ipv4() { "0.0.0.0:0".parse().ok()? } else { "[::]:0".parse().ok()? };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(SocketAddr::new(dst, 9)).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// Where the kernel keeps the ports it gives no socket of its own choice (per network
/// namespace).
const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Reserves ports `first` to `last` for the node's layers: the kernel gives them to no
/// socket that did not ask for one of them, so a layer's `bind` there rarely finds one
/// taken. Added to the ports reserved already (the kernel keeps a set: a range given twice
/// is once in it). Left in place when the agent stops (an agent started again finds it
/// there). Failure (no privilege) only makes the block shared with other sockets: logged.
pub fn reserve_ports(first: u16, last: u16) {
    let ours = format!("{first}-{last}");
    let now = match std::fs::read_to_string(RESERVED_PORTS) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            tracing::info!("cannot read {RESERVED_PORTS}: {e}; the source ports {ours} of layered connections are not reserved");
            return;
        }
    };
    if now.split(',').any(|r| r.trim() == ours) {
        return;
    }
    let new = if now.is_empty() { ours.clone() } else { format!("{now},{ours}") };
    match std::fs::write(RESERVED_PORTS, new.as_bytes()) {
        Ok(()) => tracing::info!(
            "source ports {ours} reserved for layered connections (sysctl net.ipv4.ip_local_reserved_ports)"
        ),
        Err(e) => tracing::info!(
            "cannot reserve the source ports {ours} of layered connections in {RESERVED_PORTS}: {e}; other sockets may take some of them (the layers then try others)"
        ),
    }
}

/// A name for the node: its first non-loopback IPv4 address, else the host name.
pub fn node_name() -> String {
    if let Some(ip) = node_addrs().into_iter().find(|ip| ip.is_ipv4() && !ip.is_loopback()) {
        return ip.to_string();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "node".into())
}

/// One address on one of the node's interfaces: a network the node is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    /// Interface name.
    pub name: String,
    /// Address.
    pub addr: IpAddr,
    /// Prefix length of the address's subnet.
    pub prefix: u8,
    /// The interface's MAC address (`None` when it has none, e.g. a tunnel, or it cannot be
    /// read).
    pub mac: Option<[u8; 6]>,
    /// The interface's MTU.
    pub mtu: Option<u32>,
}

impl Iface {
    /// True if `ip` is on this interface's subnet.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let m = if self.prefix == 0 { 0 } else { u32::MAX << (32 - self.prefix.min(32) as u32) };
                u32::from(a) & m == u32::from(b) & m
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let m = if self.prefix == 0 { 0 } else { u128::MAX << (128 - self.prefix.min(128) as u32) };
                u128::from(a) & m == u128::from(b) & m
            }
            _ => false,
        }
    }
}

/// The node's networks: every non-loopback, non-link-local address with its interface and
/// prefix (interfaces that are down included: a network taken down is still one of ours).
pub fn interfaces() -> Vec<Iface> {
    let mut out = Vec::new();
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } != 0 {
        return out;
    }
    let mut p = ifa;
    while !p.is_null() {
        // SAFETY: walking the list getifaddrs returned; the family says which sockaddr it is.
        unsafe {
            let a = (*p).ifa_addr;
            let m = (*p).ifa_netmask;
            if !a.is_null() && !m.is_null() {
                let name = std::ffi::CStr::from_ptr((*p).ifa_name).to_string_lossy().into_owned();
                let got = match (*a).sa_family as i32 {
                    libc::AF_INET => {
                        let s = &*(a as *const libc::sockaddr_in);
                        let mm = &*(m as *const libc::sockaddr_in);
                        Some((
                            IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))),
                            u32::from_be(mm.sin_addr.s_addr).count_ones() as u8,
                        ))
                    }
                    libc::AF_INET6 => {
                        let s = &*(a as *const libc::sockaddr_in6);
                        let mm = &*(m as *const libc::sockaddr_in6);
                        Some((
                            IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)),
                            u128::from_be_bytes(mm.sin6_addr.s6_addr).count_ones() as u8,
                        ))
                    }
                    _ => None,
                };
                if let Some((addr, prefix)) = got {
                    let link_local = matches!(addr, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
                    if !addr.is_loopback() && !link_local {
                        let (mac, mtu) = (iface_mac(&name), iface_mtu(&name));
                        out.push(Iface { name, addr, prefix, mac, mtu });
                    }
                }
            }
            p = (*p).ifa_next;
        }
    }
    // SAFETY: frees what getifaddrs allocated.
    unsafe { libc::freeifaddrs(ifa) };
    out
}

/// An interface request for `name` (`SIOCGIF*` through a datagram socket: the answer is the
/// calling thread's network namespace's, which `/sys/class/net` need not be).
fn if_ioctl(name: &str, req: libc::c_ulong) -> Option<libc::ifreq> {
    let name = base_name(name).as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return None;
    }
    // SAFETY: a zeroed ifreq is valid; the kernel fills at most the struct.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in ifr.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    // SAFETY: a socket we close below; the ioctl writes only into `ifr`.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let r = libc::ioctl(fd, req as _, &mut ifr as *mut libc::ifreq);
        libc::close(fd);
        (r == 0).then_some(ifr)
    }
}

/// The MAC address of interface `name` (`SIOCGIFHWADDR`); `None` for an interface that is not
/// Ethernet-like (a tunnel, loopback) or has an all-zero address.
pub fn iface_mac(name: &str) -> Option<[u8; 6]> {
    let ifr = if_ioctl(name, libc::SIOCGIFHWADDR as libc::c_ulong)?;
    // SAFETY: SIOCGIFHWADDR fills the hardware-address member of the union.
    let hw = unsafe { ifr.ifr_ifru.ifru_hwaddr };
    if hw.sa_family != libc::ARPHRD_ETHER {
        return None;
    }
    let mut mac = [0u8; 6];
    for (d, s) in mac.iter_mut().zip(hw.sa_data.iter()) {
        *d = *s as u8;
    }
    (mac != [0; 6]).then_some(mac)
}

/// The MTU of interface `name` (`SIOCGIFMTU`).
pub fn iface_mtu(name: &str) -> Option<u32> {
    let ifr = if_ioctl(name, libc::SIOCGIFMTU as libc::c_ulong)?;
    // SAFETY: SIOCGIFMTU fills the MTU member of the union.
    let mtu = unsafe { ifr.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).ok().filter(|&m| m > 0)
}

/// The interface of an address alias (`eth0` for `eth0:1`), as the kernel's tables name it.
pub fn base_name(name: &str) -> &str {
    name.split(':').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_and_mtu_of_interfaces() {
        assert_eq!(iface_mac("lo"), None, "loopback has no Ethernet address");
        assert!(iface_mtu("lo").is_some_and(|m| m > 0));
        for bad in ["", "no-such-if0", "a/b", "averyveryverylongname", "e\0"] {
            assert_eq!((iface_mac(bad), iface_mtu(bad)), (None, None), "{bad:?}");
        }
        assert_eq!(base_name("eth0:1"), "eth0");
        for i in interfaces() {
            assert_eq!(i.mac, iface_mac(&i.name));
            assert_ne!(i.mac, Some([0; 6]));
        }
    }
}
