"""The latency proxy's bandwidth cap (:class:`~s3kv.testing.latency_proxy.LatencyProxy`
``bytes_per_s``): a distant bucket's link for codec auto's benchmark."""

import time

import boto3

from s3kv.testing.latency_proxy import LatencyProxy

RATE = 8e6
SIZE = 2 << 20


def test_a_capped_link_takes_its_time_each_way_and_the_bytes_arrive_whole(s3_server, bucket):
    body = bytes(range(256)) * (SIZE // 256)
    with LatencyProxy(s3_server.endpoint_url, bytes_per_s=RATE) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, region_name=s3_server.region)
        t0 = time.monotonic()
        client.put_object(Bucket=bucket, Key="capped", Body=body)
        put_s = time.monotonic() - t0
        t0 = time.monotonic()
        got = client.get_object(Bucket=bucket, Key="capped")["Body"].read()
        get_s = time.monotonic() - t0
        proxy.bytes_per_s = None  # changed while it runs: uncapped
        t0 = time.monotonic()
        again = client.get_object(Bucket=bucket, Key="capped")["Body"].read()
        free_s = time.monotonic() - t0
    assert got == body and again == body
    floor = SIZE / RATE * 0.95  # the cap's own time, whatever the machine
    assert put_s >= floor and get_s >= floor, (put_s, get_s)
    assert free_s < get_s
