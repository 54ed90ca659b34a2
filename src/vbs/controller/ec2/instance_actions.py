"""EC2 actions on instances and zones: DescribeInstances (the VMs VBS knows, with their VBS disks) and
DescribeAvailabilityZones (the zones of the storage nodes)."""

from __future__ import annotations

from typing import Any

from vbs.controller.auth.keys import Principal
from vbs.controller.ec2.params import ACCOUNT_ID, dry_run, instance_id_of, matches, tag_set
from vbs.controller.ec2.query import QueryParams
from vbs.controller.fleet import describe_nodes
from vbs.controller.requests import describe_instances as describe_instances_req
from vbs.controller.runtime import Controller
from vbs.errors import InvalidParameter, NotFound


def describe_instances(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    wanted = {instance_id_of(v) for v in p.list("InstanceId")}
    filters = p.filters()
    dry_run(p)
    found = describe_instances_req.describe_instances(svc, who.tenant)
    known = {i.instance_id for i in found}
    missing = sorted(wanted - known)
    if missing:
        raise NotFound(f"The instance IDs '{', '.join(missing)}' do not exist", code="InvalidInstanceID.NotFound")
    reservations = []
    for inst in found:
        if wanted and inst.instance_id not in wanted:
            continue
        # "incoming": a live migration's destination VM, waiting for it.
        state = {"running": (16, "running"), "stopped": (80, "stopped"),
                 "incoming": (0, "pending")}.get(inst.state, (48, "terminated"))
        # An external cloud's ids show as tags vbs:cloud-id:SCHEME (attach with InstanceId SCHEME:ID).
        inst_tags = {"Name": inst.name, "vbs:host": inst.host, "vbs:vm-id": inst.vm_id,
                     **{f"vbs:cloud-id:{scheme}": cloud_id for scheme, cloud_id in sorted(inst.cloud_ids.items())}}
        facts = {"instance-id": [inst.instance_id], "instance-state-name": [state[1]],
                 "instance-state-code": [str(state[0])], "availability-zone": [svc.cfg.availability_zone],
                 "private-dns-name": [inst.host], "tag-key": list(inst_tags), "tag-value": list(inst_tags.values()),
                 "block-device-mapping.volume-id": [a.volume_id for a in inst.volumes],
                 "block-device-mapping.device-name": [a.device for a in inst.volumes],
                 **{f"tag:{k}": [v] for k, v in inst_tags.items()}}
        if not matches(filters, facts, known={"instance-id", "instance-state-name", "instance-state-code",
                                                 "availability-zone", "private-dns-name", "tag-key", "tag-value",
                                                 "block-device-mapping.volume-id",
                                                 "block-device-mapping.device-name"}):
            continue
        reservations.append({
            "reservationId": "r-" + inst.instance_id[2:], "ownerId": ACCOUNT_ID, "groupSet": [],
            "instancesSet": [{
                "instanceId": inst.instance_id, "imageId": "ami-00000000000000000",
                "instanceState": {"code": state[0], "name": state[1]}, "privateDnsName": inst.host,
                "instanceType": "vbs.vm", "placement": {"availabilityZone": svc.cfg.availability_zone},
                "tagSet": tag_set(inst_tags),
                "rootDeviceType": "ebs", "blockDeviceMapping": [
                    {"deviceName": a.device, "ebs": {"volumeId": a.volume_id, "status": a.state,
                                                     "attachTime": a.attach_time, "deleteOnTermination": False}}
                    for a in inst.volumes],
            }],
        })
    return {"reservationSet": reservations}


ZONE_FILTERS = {"zone-name", "zone-id", "region-name", "state", "zone-type", "opt-in-status"}


def describe_availability_zones(svc: Controller, p: QueryParams, who: Principal) -> dict[str, Any]:
    """The zones of the storage nodes (``available`` while one of its nodes is up)."""
    names = p.list("ZoneName")
    zone_ids = p.list("ZoneId")
    filters = p.filters()
    dry_run(p)
    with svc.db.read() as s:
        zones = describe_nodes.availability_zones(s, svc.cfg.heartbeat_timeout_s, svc.cfg.availability_zone,
                                                  svc.cfg.region)
    unknown = [n for n in names if n not in {z.zone_name for z in zones}] + [
        i for i in zone_ids if i not in {z.zone_id for z in zones}]
    if unknown:
        raise InvalidParameter(f"Invalid availability zone: [{unknown[0][:64]}]", code="InvalidParameterValue")
    info = []
    for z in zones:
        facts: dict[str, list[str]] = {
            "zone-name": [z.zone_name], "zone-id": [z.zone_id], "region-name": [z.region_name], "state": [z.state],
            "zone-type": ["availability-zone"], "opt-in-status": ["opt-in-not-required"]}
        if (names and z.zone_name not in names) or (zone_ids and z.zone_id not in zone_ids) \
                or not matches(filters, facts, known=ZONE_FILTERS):
            continue
        info.append({"zoneName": z.zone_name, "zoneState": z.state, "regionName": z.region_name,
                     "zoneId": z.zone_id, "zoneType": "availability-zone", "optInStatus": "opt-in-not-required",
                     "messageSet": []})
    return {"availabilityZoneInfo": info}
